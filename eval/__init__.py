"""spectrain.eval."""
