"""spectrain.data."""
