//! t10: the configurations shipped in `cluster-config/` load and validate, the
//! built-in default is `single.toml`, and the three `local3` nodes agree on their
//! cluster section (equal fingerprints) while each names itself.

use std::path::PathBuf;
use tally_server::config::SINGLE_NODE_TOML;
use tally_server::Config;

fn shipped(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../cluster-config").join(rel)
}

#[test]
fn single_toml_is_the_built_in_default_and_runs_one_node_on_7070_and_6380() {
    let from_file = Config::load(&shipped("single.toml")).expect("single.toml is valid");
    let text = std::fs::read_to_string(shipped("single.toml")).expect("readable");
    assert_eq!(text, SINGLE_NODE_TOML, "the binary must embed the shipped file");
    assert_eq!(Config::single_node().expect("built-in config is valid"), from_file);
    assert_eq!(from_file.cluster.nodes.len(), 1);
    let me = from_file.this_node().expect("node is a member");
    assert_eq!(me.http.to_string(), "127.0.0.1:7070");
    assert_eq!(
        me.resp.map(|a| a.to_string()).as_deref(),
        Some("127.0.0.1:6380"),
        "RESP beside a local Redis"
    );
    assert_eq!(from_file.node.data_dir, PathBuf::from("./data"));
}

#[test]
fn local3_nodes_load_share_one_fingerprint_and_differ_only_in_their_node_section() {
    let configs: Vec<Config> = (1..=3)
        .map(|i| Config::load(&shipped(&format!("local3/node{i}.toml"))).expect("local3 config is valid"))
        .collect();
    for (i, c) in configs.iter().enumerate() {
        let n = i + 1;
        assert_eq!(c.cluster.nodes.len(), 3);
        assert_eq!(c.node.id, format!("node{n}"));
        assert_eq!(c.node.data_dir, PathBuf::from(format!("./data/node{n}")));
        let me = c.this_node().expect("node is a member");
        assert_eq!(me.http.to_string(), format!("127.0.0.1:707{n}"));
        assert_eq!(me.peer.to_string(), format!("127.0.0.1:717{n}"));
        assert_eq!(me.raft.to_string(), format!("127.0.0.1:727{n}"));
        assert_eq!(me.resp.map(|a| a.to_string()), Some(format!("127.0.0.1:638{n}")));
        assert_eq!(c.cluster, configs[0].cluster, "node{n}'s [cluster] differs from node1's");
        assert_eq!(c.cluster.fingerprint(), configs[0].cluster.fingerprint());
    }
    assert_eq!(configs[0].cluster.replicas(), 3, "three members default to three copies");
    let single = Config::single_node().expect("valid");
    assert_ne!(single.cluster.fingerprint(), configs[0].cluster.fingerprint());
    assert_eq!(single.cluster.replicas(), 1, "a single node keeps one copy, without range groups");
}

#[test]
fn every_toml_file_under_cluster_config_validates() {
    let mut seen = 0;
    let mut dirs = vec![shipped("")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("cluster-config is readable") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "toml") {
                Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                seen += 1;
            }
        }
    }
    assert!(seen >= 4, "found only {seen} configs");
}

#[test]
fn the_readme_documents_every_field() {
    let readme = std::fs::read_to_string(shipped("README.md")).expect("README.md exists");
    let c = Config::single_node().expect("valid");
    let value = toml::Value::try_from(&c).expect("config serializes");
    let mut missing = Vec::new();
    let mut check = |table: &toml::Table| {
        for key in table.keys() {
            if !readme.contains(&format!("`{key}`")) {
                missing.push(key.clone());
            }
        }
    };
    for section in ["cluster", "node", "http", "resp", "engine"] {
        let table = value.get(section).and_then(|v| v.as_table()).expect("section");
        check(table);
    }
    let node = value["cluster"]["nodes"][0].as_table().expect("node table");
    check(node);
    assert!(missing.is_empty(), "README.md does not document {missing:?}");
}
