"""Does a decision.json say what its numbers show? Each recommendation field re-derived from the
file's own figures (the CIs, the gains, the break-even) by the rules' words in docs/decision.md,
written apart from draftport.evaluation.decision; used on pipeline runs of different worlds."""


def says_what_the_numbers_show(dec: dict) -> list[str]:
    """The fields whose value disagrees with the numbers (empty: all agree)."""
    bad = []
    rec, be = dec["recommendation"], dec["costmodel"]["break_even_accept_length"]
    text = " ".join(rec["text"])

    p0 = dec["phases"].get("phase0")
    src = ((dec.get("serving") or {}).get("drafters") or {}).get("source")
    if p0 is not None:
        deploy = p0["ci"][0] > be
        why = f"phase0 CI {p0['ci']} vs break-even {be}"
        if src is not None:  # R4 with R11: the source's best configuration at the smallest batch size served
            row = src["per_batch"][0]
            deploy = row["speculate"] and row["best"]["tok_s_ci"][0] > row["target_alone_tok_s"]
            why = f"its best {row['best']['tok_s_ci']} tok/s vs the target alone's {row['target_alone_tok_s']}"
        if rec["deploy_source_now"] != deploy:
            bad.append(f"deploy_source_now {rec['deploy_source_now']} but {why}")
        if not deploy and "Do not deploy the source drafter as fetched" not in text:
            bad.append("the text does not say: do not deploy the source as fetched")

    gain = dec["gain"]
    if gain:
        last = gain[-1]
        if last["significant"]:
            init = last["better"]
        else:
            winners = {g["better"] for g in gain[:-1] if g["significant"]}
            init = winners.pop() if len(winners) == 1 else "either"
        if rec["init"] != init:
            bad.append(f"init {rec['init']} but the gains say {init}")

    def beats(r):  # R2: at the row's best configuration when it has one, else at eval.k
        c = r.get("best_config")
        return c["tok_s_ci"][0] > c["target_alone_tok_s"] if c else r["ci"][0] > be

    ok = {arm: [r["n_samples"] for r in rows if beats(r)] for arm, rows in dec["curves"].items()}
    which = ("source", "scratch") if rec["init"] == "either" else (rec["init"],)
    found = [min(ok[a]) for a in which if ok.get(a)]
    if rec["n_samples"] != (min(found) if found else None):
        bad.append(f"n_samples {rec['n_samples']} but the smallest n above break-even is {found}")

    base = "source" if rec["init"] == "either" else rec["init"]
    ag = (dec.get("answers_gain") or {}).get(base)
    regen = None if not ag else bool(ag[-1]["significant"] and ag[-1]["diff"] > 0)
    if rec["regenerate"] != regen:
        bad.append(f"regenerate {rec['regenerate']} but regenerated - dataset is {ag[-1] if ag else None}")

    rg = dec.get("recipe_gain") or {}
    if rg and rec["init"] != "scratch":
        N = min(g[-1]["n_samples"] for g in rg.values())
        at = {r: next(x for x in g if x["n_samples"] == N) for r, g in rg.items()}
        good = [(x["diff"], r) for r, x in at.items() if x["significant"] and x["diff"] > 0]
        if rec["recipe"] != (max(good)[1] if good else "plain"):
            bad.append(f"recipe {rec['recipe']} but the recipes' gains at n={N} are {at}")

    p2 = dec.get("phase2_gain")
    if p2 is not None:
        v = "no significant gain" if not p2["significant"] else "helps" if p2["diff"] > 0 else "hurts"
        if rec["phase2"] != v:
            bad.append(f"phase2 {rec['phase2']} but phase2 - phase1 is {p2}")

    if dec.get("traffic") is not None:
        bad += _traffic_disagreements(dec["traffic"], text)

    ch = rec.get("chosen")
    if (
        ch is not None
        and ch.get("hours") is not None
        and (ch["hours"]["regenerate"] == 0) != (rec["regenerate"] is False)
    ):
        bad.append(f"the chosen drafter's hours {ch['hours']} disagree with regenerate {rec['regenerate']}")
    return bad


def _traffic_disagreements(t: dict, text: str) -> list[str]:
    """R10: the weighted figure is the shares' sum; named are exactly the sets (share >= min_share)
    and the context buckets where the recommended drafter's paired difference to a rival lies below 0."""
    bad = []
    if t["weighted"]:
        for ph, row in t["phases"].items():
            w = sum(s["share"] * row["sets"][s["name"]]["accept_length"] for s in t["sets"])
            if abs(w - row["weighted"]["accept_length"]) > 1e-9:
                bad.append(f"{ph}: weighted {row['weighted']['accept_length']} but the shares' sum is {w}")
    for s in t["sets"]:
        worse = any(v["sets"][s["name"]]["ci"][1] < 0 for v in t["vs"].values())
        if (f"On the set {s['name']} (" in text) != (worse and s["share"] >= t["min_share"]):
            bad.append(f"set {s['name']} (share {s['share']}): significantly worse {worse}, named or not disagrees")
    for j, name in enumerate((t.get("context_buckets") or {}).get("names") or []):
        rows = (t.get("buckets_vs") or {}).values()
        worse = any(r[j]["ci"] is not None and r[j]["ci"][1] < 0 for r in rows)
        if (f"At verify positions {name} (" in text) != worse:
            bad.append(f"bucket {name}: significantly worse {worse}, named or not disagrees")
    return bad
