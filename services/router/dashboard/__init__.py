"""The router's live dashboard: `/dashboard` on its HTTP port, and the JSON behind it.

- `recent.py`  the router's recent requests per logical model (rates, percentiles, overlap)
- `state.py`   the mesh every 2 s (every node's GetNodeInfo, hosts, targets), an hour of it,
               and the open pages' feeds
- `web.py`     the routes: the page, its static files, `/api/dashboard` and its event stream
- `static/`    the page (plain HTML, CSS and JavaScript) and uPlot 1.6.32, vendored with its
               licence: nothing is fetched from outside the router
"""
