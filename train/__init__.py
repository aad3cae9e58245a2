"""spectrain.train."""
