"""Building blocks of the decoder: norms, rotary embeddings, linear maps, paged attention."""
