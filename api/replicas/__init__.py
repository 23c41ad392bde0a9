"""`pagedserve serve --num-replicas N` (or --min/--max-replicas): the same OpenAI API as a Ray
Serve application. Ray Serve's HTTP proxy in front; an ingress deployment serving api/app.py
unchanged, whose EngineClient (client.py) forwards to the engine deployment
(engine/replicas/), one AsyncEngine and KV pool per replica. Only api.replicas.options is
imported by the CLI without the replica flags, and it does not import Ray."""
