"""The launcher: the `fleetrl` command, and the local fleet (every service a supervised child process).

It may import services (it runs them); the library and the services never import it.

- `fleet.Fleet`: starts embedded NATS + Valkey (or uses given URLs), then gateway, replay,
  reward, learner and N actors under a `supervisor.Supervisor`; records where everything
  listens in `<run_dir>/fleet.json`; `scale` changes the actor count of a running fleet.
- `cli`: `fleetrl up`, `fleetrl scale`, `fleetrl demo` (the addition demo and its report).
- `main`: the `fleetrl` command; `jobs_cli`: `fleetrl submit|status|watch|cancel|jobs|download|sweep`.
- `demo`, `report`, `evaljob`, `episode_eval`: the demo, its report, `fleetrl eval`.
- `top`: `fleetrl top`, a live terminal view over the gateway's API.
- `embedded`: embedded nats-server and Valkey processes (`fleetrl up`, `fleetrl infra`, tests).
- `configdoc`: docs/CONFIG.md generated from every service's config models
  (`python -m fleetrl.launcher.configdoc --write docs/CONFIG.md`).

Services are configured only through their environment variables (`FLEETRL_<SERVICE>_<FIELD>`),
the same interface docker-compose.yml uses, so the two launchers cannot drift apart.
"""
