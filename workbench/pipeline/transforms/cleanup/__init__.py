"""Post-export cleanups (stage ``post_export``).

cleanups.py   cleanup_noop_slice, cleanup_noop_add, cleanup_input_constraints, cleanup_identity_dtype_cast
"""
