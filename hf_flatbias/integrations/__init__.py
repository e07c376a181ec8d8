"""The flatness steps inside other libraries' trainers (each module needs its library: `pip install "hf_flatbias[X]"`)."""
