"""learner stage package (see README file map)."""
