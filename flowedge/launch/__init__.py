"""Starting, stopping and asking nodes from the command line: `serve | join | up | down | prompt | status`,
the local cluster and its supervisor, and the node's TOML file reader."""
