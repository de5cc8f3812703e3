"""What runs the product on local ranks for tests, benchmarks and checks - not used in training.

``local_world`` (a reusable pool of local gloo or NCCL rank processes), ``threaded_world`` (ranks
as threads of one process), ``gloo_device`` (one gloo transport device per process) and
``virtual_cuda`` (the emulated CUDA device of the device audit). The harness imports only the
foundation; the product imports it only to start local ranks (``verify-groups``, the functional
recipes' launcher, the device audit).
"""
