"""What a node process runs: head, stage, standby and drafter nodes, their config, membership, the
head's partition plan and requests, and the composition root (`roots.build_node`) that wires them."""
