

def get_inputs():
    raise RuntimeError("dataset missing")


def computation(x):
    return x
