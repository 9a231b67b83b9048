"""The one rule for file names a peer or a manifest may hand us: a plain name inside one directory.

A stage writes files the head names (side files, the shard file named in the manifest) into its cache;
a name with a path separator, a leading dot ('..', hidden temporaries), a NUL or an absolute path could
escape that directory or clobber a file in flight, so it is refused wherever such a name is read.
"""
from __future__ import annotations

MAX_FILE_NAME_CHARS = 255


def is_plain_file_name(name: object) -> bool:
    """True for a name like 'stage-1.safetensors': non-empty, no separator, no leading dot, no NUL."""
    return (isinstance(name, str) and 0 < len(name) <= MAX_FILE_NAME_CHARS and not name.startswith(".")
            and not any(c in name for c in "/\\\0"))
