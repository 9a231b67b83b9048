"""Partition planning: which layers each stage serves, from the devices' memory and speed."""
