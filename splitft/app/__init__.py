"""The application around the library: the command line, tasks, runs and their data."""
