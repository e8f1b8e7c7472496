//! The stacks read from the BPF tables, stored once as a tree of callers.
//!
//! Stacks share their outer frames (`main`, the event loop, the request handler), so
//! each stack is kept as a path in a tree from its outermost frame to its innermost
//! one: a stack costs one node per frame it does not share with a stack already
//! stored, about 24 bytes with its index slot, plus 16 bytes for its hash. A flat
//! copy of every stack cost 8 bytes per frame of every stack, about 350 bytes for a
//! 40-frame stack. 131,072 stacks of a binary recursion 17 calls deep (655,365
//! nodes, a hard case: every stack ends in nodes of its own) take
//! about 19 MiB here against 47 MiB as flat copies; stacks that differ only in their
//! innermost frames take far less.
//!
//! Nodes are counted by reference (children plus the stacks ending at them), so
//! forgetting a stack (`--retain-exited`) frees the nodes no other stack uses, and
//! their slots are used again.
//!
//! Node ids are dense, so a pass over the stacks can mark the nodes it visited in a
//! vector ([`NodeMarks`]): symbolizing, each frame once per process image.

use std::hash::BuildHasher as _;

use hashbrown::{DefaultHashBuilder, HashMap, HashTable};

/// A node of the tree: one frame in the context of all its callers.
pub type NodeId = u32;

/// Parent of an outermost frame.
const NO_NODE: NodeId = NodeId::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    /// The frame's return address.
    address: u64,
    /// The caller's node, or [`NO_NODE`].
    parent: NodeId,
    /// Children plus stacks ending here; zero on the free list.
    refs: u32,
}

/// Every stored stack, by the hash the BPF programs gave it.
#[derive(Debug, Default)]
pub struct StackStore {
    nodes: Vec<Node>,
    /// Slots of nodes freed by [`StackStore::forget`], used again first.
    free: Vec<NodeId>,
    /// The nodes by (parent, address), so that a stack finds the path it shares.
    children: HashTable<NodeId>,
    hasher: DefaultHashBuilder,
    /// Each stack's innermost node; [`NO_NODE`] for a stack of no frames.
    stacks: HashMap<u64, NodeId>,
    /// The path of the last stack inserted, outermost first, and its frames: the
    /// next stack most often shares its outer part, which is then not looked up.
    last_path: Vec<(u64, NodeId)>,
}

impl StackStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the stack with hash `stack` is stored.
    pub fn contains(&self, stack: u64) -> bool {
        self.stacks.contains_key(&stack)
    }

    /// Stacks stored.
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    /// Whether no stack is stored.
    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }

    /// Nodes in use (frames stored once per distinct caller path).
    pub fn nodes_in_use(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// One more than the largest node id: the length of a vector indexed by node.
    pub fn node_bound(&self) -> usize {
        self.nodes.len()
    }

    /// Stores the stack with hash `stack`, `frames` innermost first. A stack already
    /// stored under that hash is kept as it is: a hash names one stack for as long
    /// as its process lives.
    pub fn insert(&mut self, stack: u64, frames: &[u64]) {
        if self.stacks.contains_key(&stack) {
            return;
        }
        // The outer frames shared with the last stack inserted: their nodes are
        // still in use (by that stack), so still valid.
        let shared = self
            .last_path
            .iter()
            .zip(frames.iter().rev())
            .take_while(|((last, _), address)| last == *address)
            .count();
        self.last_path.truncate(shared);
        let mut parent = self.last_path.last().map_or(NO_NODE, |&(_, id)| id);
        // Below a node this stack added, nothing can exist yet: no lookups.
        let mut added = false;
        for &address in frames.iter().rev().skip(shared) {
            parent = match added {
                true => self.add_child(parent, address),
                false => match self.find_child(parent, address) {
                    Some(id) => id,
                    None => {
                        added = true;
                        self.add_child(parent, address)
                    }
                },
            };
            self.last_path.push((address, parent));
        }
        if parent != NO_NODE {
            self.nodes[parent as usize].refs += 1;
        }
        self.stacks.insert(stack, parent);
    }

    /// Stores many stacks at once (see [`StackStore::insert`]), in an order that
    /// lets each share the most of its path with the one before: far fewer
    /// lookups than in the order a table gives them.
    pub fn insert_many<'a>(&mut self, stacks: impl IntoIterator<Item = (u64, &'a [u64])>) {
        let mut stacks: Vec<(u64, &[u64])> = stacks.into_iter().collect();
        // Outermost frames first: the order of the paths in the tree.
        stacks.sort_unstable_by(|(_, a), (_, b)| a.iter().rev().cmp(b.iter().rev()));
        for (hash, frames) in stacks {
            self.insert(hash, frames);
        }
    }

    /// Makes room for `stacks` more stacks and `nodes` more nodes.
    pub fn reserve(&mut self, stacks: usize, nodes: usize) {
        self.stacks.reserve(stacks);
        self.nodes.reserve(nodes.saturating_sub(self.free.len()));
        let (nodes_now, hasher) = (&self.nodes, &self.hasher);
        self.children.reserve(nodes, |&id| {
            let node = &nodes_now[id as usize];
            hasher.hash_one((node.parent, node.address))
        });
    }

    /// The node of `address` called from `parent`, if there is one.
    fn find_child(&self, parent: NodeId, address: u64) -> Option<NodeId> {
        let hash = self.hasher.hash_one((parent, address));
        self.children
            .find(hash, |&id| {
                let node = &self.nodes[id as usize];
                node.parent == parent && node.address == address
            })
            .copied()
    }

    /// Adds the node of `address` called from `parent` (which has none yet); holds a
    /// reference on `parent`.
    fn add_child(&mut self, parent: NodeId, address: u64) -> NodeId {
        let hash = self.hasher.hash_one((parent, address));
        let node = Node {
            address,
            parent,
            refs: 0,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        };
        if parent != NO_NODE {
            self.nodes[parent as usize].refs += 1;
        }
        let (nodes, hasher) = (&self.nodes, &self.hasher);
        self.children.insert_unique(hash, id, |&id| {
            let node = &nodes[id as usize];
            hasher.hash_one((node.parent, node.address))
        });
        id
    }

    /// Forgets the stack with hash `stack`; the nodes only it used are freed.
    pub fn forget(&mut self, stack: u64) {
        let Some(mut id) = self.stacks.remove(&stack) else {
            return;
        };
        // Its nodes may be freed below.
        self.last_path.clear();
        while id != NO_NODE {
            let node = &mut self.nodes[id as usize];
            node.refs -= 1;
            if node.refs > 0 {
                break;
            }
            let (parent, address) = (node.parent, node.address);
            let hash = self.hasher.hash_one((parent, address));
            if let Ok(entry) = self.children.find_entry(hash, |&other| other == id) {
                entry.remove();
            }
            self.free.push(id);
            id = parent;
        }
    }

    /// The frames of the stack with hash `stack`, innermost first, each with its
    /// node; nothing for a stack not stored.
    pub fn nodes(&self, stack: u64) -> StackNodes<'_> {
        StackNodes {
            store: self,
            next: self.stacks.get(&stack).copied().unwrap_or(NO_NODE),
        }
    }

    /// The return addresses of the stack with hash `stack`, innermost first.
    pub fn frames(&self, stack: u64) -> impl Iterator<Item = u64> + '_ {
        self.nodes(stack).map(|(_, address)| address)
    }
}

/// The nodes of one stack, innermost first: see [`StackStore::nodes`].
#[derive(Debug, Clone)]
pub struct StackNodes<'a> {
    store: &'a StackStore,
    next: NodeId,
}

impl Iterator for StackNodes<'_> {
    type Item = (NodeId, u64);

    fn next(&mut self) -> Option<Self::Item> {
        if self.next == NO_NODE {
            return None;
        }
        let id = self.next;
        let node = &self.store.nodes[id as usize];
        self.next = node.parent;
        Some((id, node.address))
    }
}

/// The nodes a pass over the stacks has visited, per address space: a node shared
/// by the stacks of two processes means a different place in each, so a mark is
/// kept with the space (a small number the pass gives each) it was made for.
#[derive(Debug)]
pub struct NodeMarks {
    /// Per node: the number plus one of the space it was marked for (zero: none).
    marks: Vec<u32>,
}

impl NodeMarks {
    /// No node of `store`, as it is now, marked.
    pub fn new(store: &StackStore) -> Self {
        Self {
            marks: vec![0; store.node_bound()],
        }
    }

    /// Marks `node` for `space`; returns whether it was not marked for it yet.
    pub fn mark(&mut self, node: NodeId, space: u32) -> bool {
        let Some(mark) = self.marks.get_mut(node as usize) else {
            return false;
        };
        let new = *mark != space.wrapping_add(1);
        *mark = space.wrapping_add(1);
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(store: &StackStore, stack: u64) -> Vec<u64> {
        store.frames(stack).collect()
    }

    #[test]
    fn stacks_read_back_innermost_first_and_share_their_callers() {
        let mut store = StackStore::new();
        store.insert(1, &[0x30, 0x20, 0x10]);
        store.insert(2, &[0x31, 0x20, 0x10]);
        store.insert(3, &[0x20, 0x10]);
        store.insert(4, &[]);
        assert_eq!(frames(&store, 1), [0x30, 0x20, 0x10]);
        assert_eq!(frames(&store, 2), [0x31, 0x20, 0x10]);
        assert_eq!(frames(&store, 3), [0x20, 0x10]);
        assert!(store.contains(4) && frames(&store, 4).is_empty());
        assert!(!store.contains(5) && frames(&store, 5).is_empty());
        assert_eq!(store.len(), 4);
        assert_eq!(store.nodes_in_use(), 4, "0x10 and 0x20 are stored once");

        // The same frames under another caller are another path.
        store.insert(6, &[0x30, 0x20, 0x11]);
        assert_eq!(store.nodes_in_use(), 7);
        assert_eq!(frames(&store, 6), [0x30, 0x20, 0x11]);
    }

    #[test]
    fn a_hash_already_stored_keeps_its_stack() {
        let mut store = StackStore::new();
        store.insert(1, &[0x30, 0x20]);
        store.insert(1, &[0x99]);
        assert_eq!(frames(&store, 1), [0x30, 0x20]);
        assert_eq!(store.nodes_in_use(), 2);
    }

    #[test]
    fn forgetting_frees_only_the_nodes_no_other_stack_uses() {
        let mut store = StackStore::new();
        store.insert(1, &[0x30, 0x20, 0x10]);
        store.insert(2, &[0x31, 0x20, 0x10]);
        store.insert(3, &[0x20, 0x10]);
        store.forget(1);
        assert_eq!(store.nodes_in_use(), 3);
        assert_eq!(frames(&store, 2), [0x31, 0x20, 0x10]);
        store.forget(2);
        assert_eq!(store.nodes_in_use(), 2, "0x20 still ends stack 3");
        assert_eq!(frames(&store, 3), [0x20, 0x10]);
        store.forget(3);
        store.forget(3);
        assert_eq!(store.nodes_in_use(), 0);
        assert!(store.is_empty());

        // Freed slots are used again, and the index finds the new nodes.
        store.insert(7, &[0x50, 0x40]);
        store.insert(8, &[0x51, 0x40]);
        assert_eq!(
            store.node_bound(),
            4,
            "the four slots of the first stacks, and no more"
        );
        assert_eq!(frames(&store, 7), [0x50, 0x40]);
        assert_eq!(frames(&store, 8), [0x51, 0x40]);
        assert_eq!(store.nodes_in_use(), 3);
    }

    #[test]
    fn churn_keeps_the_store_bounded() {
        let mut store = StackStore::new();
        for round in 0..50u64 {
            for i in 0..100u64 {
                let hash = round * 1000 + i;
                store.insert(hash, &[0x1000 + i, 0x2000 + i % 7, 0x3000, 0x4000 + round]);
            }
            if round > 0 {
                for i in 0..100u64 {
                    store.forget((round - 1) * 1000 + i);
                }
            }
        }
        assert_eq!(store.len(), 100);
        assert!(store.node_bound() <= 2 * store.nodes_in_use() + 10);
        assert_eq!(
            frames(&store, 49_005),
            [0x1005, 0x2005, 0x3000, 0x4000 + 49]
        );
    }

    #[test]
    fn a_mark_holds_for_its_space_only() {
        let mut store = StackStore::new();
        store.insert(1, &[0x30, 0x20]);
        let mut marks = NodeMarks::new(&store);
        let (leaf, _) = store.nodes(1).next().expect("a frame");
        assert!(marks.mark(leaf, 0), "new");
        assert!(!marks.mark(leaf, 0), "marked already");
        assert!(marks.mark(leaf, 1), "new for another space");
    }
}
