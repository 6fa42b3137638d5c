"""What a command line says: the loader it runs and its settings (loadspec), the
server it is or asks (servers, lmstudio, ollama), through wrappers and shell scripts
(shell). Pure: text in, plain data out; reading the model files is foresight's."""
