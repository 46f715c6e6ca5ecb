import jax

def get_inputs(:
    pass
