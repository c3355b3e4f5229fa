"""Everything said about a study, in words and units.

- `gather.gather` -> `facts.ReportData`; `markdown.write_report` writes report.md and report.html
  (`html.render_html`); `winner`, `confirmation`, `sweep_figures` make their sections.
- `progress.Progress`: the live lines of `tune run`; `terminal`: tables printed by `tune bench`
  and `tune workload fit`.
"""
