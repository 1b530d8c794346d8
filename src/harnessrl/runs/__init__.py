"""One run of harnessrl, from a config to a summary: project resolution (harness, tasks, grader),
the run directory, the preflight check, the train-and-evaluate flow, the summary and its plot, and the
scaffold that `harnessrl init` writes.

- `project`: a config's harness, task source and grader, resolved into what runs;
- `rundir`: how a run directory is used (new, fresh, resume, replace);
- `preflight`: one graded attempt before training (`harnessrl check`);
- `context`: the clients, controller and trainer context a run works with;
- `flow`: the whole run (`harnessrl train`, `harnessrl.train`);
- `summary`, `plot`: summary.json and reward_curve.png;
- `scaffold`: `harnessrl init` and its templates.
"""
