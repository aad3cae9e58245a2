"""spectrain.heads."""
