"""The guard's judgement: plain data in, plain data out, no I/O.

Everything here imports only the standard library and this package
(tests/test_core.py proves it in a fresh interpreter): the snapshot the
sensor fills, the config as the policy reads it, what a command line says
(argv/), which units are loaders (classify), what to do about them (policy,
step), and the events that say so. The loop around it (daemon, sensor, act)
and the rooms below (system/, foresight/, block/) do the I/O.
"""
