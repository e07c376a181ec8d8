"""Flatness steps inside other libraries' trainers; each module needs its extra (`pip install "hf_flatbias[trl]"`)."""
