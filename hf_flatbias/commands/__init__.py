"""Sub-commands of the ``hf-flatbias`` CLI: each module defines ``register(subparsers)``; cli.COMMANDS lists them."""
