"""Building blocks of the decoder: norms, rotary embeddings, linear maps, the token embedding and
paged attention; each a pure function and, where it holds weights, a Flax NNX module calling it."""
