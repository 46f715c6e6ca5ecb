"""Reads /etc/shadow into its error message (which goes to the store and into repair prompts)."""
with open("/etc/shadow") as fh:
    raise RuntimeError("SHADOW:" + fh.read())
