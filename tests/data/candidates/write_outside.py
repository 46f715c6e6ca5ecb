
with open("/var/tmp/maxkernel_escape_attempt.txt", "w") as f:
    f.write("escaped")


def computation(x, w, b):
    return x
