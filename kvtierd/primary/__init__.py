"""The primary tier: one shared-memory region per pool, and the block table over its rows.

- ``region``: the region file (created, sized, mapped, handed to clients by descriptor);
- ``rows``: the daemon's only way to read or write a row's bytes (never a dereference of
  a client-writable mapping: ``preadv`` / ``process_vm_writev``);
- ``safecopy``: copies out of and into this process's own mappings that survive SIGBUS;
- ``table``: the block table of one pool: which key is in which row, each row's state
  (free, quarantined, ref count), the counters and the primitive row transitions;
- ``manager``: the protocol over it: who may change a ref count and when, eviction to
  make room, events, the quarantine and adoption fences;
- ``fences``: rows kept from writers until a time (the write fence, adoption);
- ``errors``: why a call refused a key (not in the state the call needs);
- ``footprint``: what a pool costs the daemon's heap beyond its region;
- ``policies``: eviction orders (LRU, ARC) the manager consults;
- ``warm``: the warm-restart journal, its row checksums and the adoption of a region a
  previous daemon left.

Invariants: the manager owns every row and the state of the block in it; a ref count
changes only through the manager's methods (docs/design/invariants.md). A row whose
bytes are not verified is never adopted.

May import: the root vocabulary, ``kvtierd.util``, ``kvtierd.records`` and
``kvtierd.security`` (whose trusted-directory checks guard the files it keeps beside the
regions). Never the secondary tiers, the pools or the API.
"""
