# Makes tests/ a package, so pytest puts the repository root on sys.path and the in-tree
# packages import without installing.
