"""producers stage package (see README file map)."""
