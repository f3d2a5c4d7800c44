"""A mesh's configuration: the topology file (nodes, models, mesh settings) and its checks."""
