"""Sub-commands of the ``hf-flatbias`` CLI: each module here defines ``register(subparsers)``."""
