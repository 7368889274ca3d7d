"""The `ragckpt` command line."""
