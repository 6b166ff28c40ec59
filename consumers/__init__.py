"""consumers stage package (see README file map)."""
