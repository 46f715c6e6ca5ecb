import time

time.sleep(10_000)


def computation(x, w, b):
    return x
