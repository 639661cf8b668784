"""Op kernels of the VA-1 command processor (numpy, no per-element Python).

Each kernel takes zero-copy views of device memory that the validator resolved and
writes its result into the output view. Results are computed in f32 (f64 for the
transcendental GELU/SIGMOID) and rounded once to the output dtype.
"""
