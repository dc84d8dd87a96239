"""Draft sources: text that already exists, as drafts. `history.py` is a worker's index of
what the run wrote for each prompt (its siblings in the group, earlier rollouts), kept off
the engine's critical path; `suffix_index.py` finds a draft as the continuation of the
longest suffix match, over token arenas (`suffix_arena.py`). Host-side numpy: they import
neither the engine nor the policies (the engine asks them for drafts and verifies
them like the drafter's).
"""
