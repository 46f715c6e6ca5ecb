"""Overwrites the reference sets file in its run dir, hoping the harness caches the forgery."""

with open("reference_sets.npz", "wb") as f:
    f.write(b"not the reference")


def computation(x, w, b):
    return x
