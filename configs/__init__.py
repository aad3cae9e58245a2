"""spectrain.configs."""
