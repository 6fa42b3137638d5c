"""The incident in a box: `./demo/run` (README.md, "Try it in one command")."""
