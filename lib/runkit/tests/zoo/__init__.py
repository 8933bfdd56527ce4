"""Users' own LightningModules and DataModules, none a classifier, each logging with sync_dist."""
