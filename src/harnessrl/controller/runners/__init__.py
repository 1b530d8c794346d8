"""runners: the backends an attempt runs on, all behind `controller.runner.Runner`.

`local` (a subprocess per attempt; a uid of its own as root), `forkserver` + `fork_zygote` (Python
harnesses forked from a process that preloaded their SDK), `sandbox` + `sandbox_init` + `bridge` +
`cgroups` (bubblewrap: the default wherever it works), `ray_runner` (attempts as Ray tasks),
`kubernetes` + `kubernetes_api` + `kubernetes_jobs` + `kubernetes_tracker` (attempts as Jobs).
"""
