"""The model runner: shape buckets, input packing, KV cache arrays, compiled and eager steps."""
