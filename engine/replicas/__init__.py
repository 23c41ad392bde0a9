"""The engine side of Ray Serve replicas (`pagedserve serve --num-replicas N`): each replica of
the engine deployment owns one AsyncEngine and its KV pool. Imported only when the replica
flags are given: nothing here is loaded by a single-process server."""
