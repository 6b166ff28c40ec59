"""streams stage package (see README file map)."""
