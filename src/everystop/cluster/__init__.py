"""Scale out: engine replicas on Ray Serve behind the design's load-aware router.

    replica.py  one AsyncEngine as a Ray Serve replica: generate (streamed), load reports
    router.py   the Ray Serve RequestRouter running `everystop.routing`'s policies
    registry.py where the ingress finds the routers Ray built in its process
    front.py    the ingress's engine front: route, retry refusals and early deaths, account
    metrics.py  every replica's series with a `replica` label, and the router's decisions
    deploy.py   `everystop serve --replicas N`: start or join Ray, deploy, serve the app

Ray is imported only here, and this package only when `--replicas` asks for it.
"""
