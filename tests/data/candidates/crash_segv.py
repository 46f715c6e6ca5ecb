import os
import signal

os.kill(os.getpid(), signal.SIGSEGV)


def computation(x, w, b):
    return x
