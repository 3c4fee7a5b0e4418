"""Table stacking: several logical tables stored and stepped as one.

* `plan`: which tables form a group (one physical table), member offsets;
* `members`: a group's members inside one device's step (ids, counts, gates);
* `state`: a group's state <-> its members' states (checkpoints, logical reads).

Import the submodules; this package imports none of them, so that
`pallas_emb.state` (which initialises stacked rows with `members`) and
`stacking.state` (which builds `TableState`s) form no circle.
"""
