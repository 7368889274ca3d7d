"""One module per feature area; each exports `commands`."""
