import ctypes

# A real segmentation fault (a null read), raised by the kernel: a candidate that merely sends itself
# SIGSEGV is pid 1 of its own pid namespace in a zygote-forked job, where a self-sent signal is ignored.
ctypes.string_at(0)


def computation(x, w, b):
    return x
