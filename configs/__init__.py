"""Shipped experiment configs (YAML); `jaxpar train NAME` finds them by name."""
