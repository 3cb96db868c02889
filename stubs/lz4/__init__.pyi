# the part of python-lz4 Capsule uses (it ships no types)
