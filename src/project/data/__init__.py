"""Data: a DataModule over in-memory arrays, and the digits data set that ships with the package."""
