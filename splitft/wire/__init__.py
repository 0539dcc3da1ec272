"""The wire: what crosses between edge and cloud, and how it is checked."""
